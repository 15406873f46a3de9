"""CollectiveWeightSync on CPU: gloo instead of NCCL, a stand-in receiver instead of vLLM.

vLLM's NCCL weight-transfer engine needs a GPU, which this machine lacks, so the engines
here are ``collective_receiver.py`` processes: real HTTP servers with vLLM's routes and
JSON bodies that join the trainer's group (gloo over the trainer's TCPStore) and cut the
packed bucket broadcasts by the ``/update_weights`` metadata. The trainer side is the
production code path; only the backend string (``gloo``) differs from a GPU run.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig
from turnrl.grpo_core.weight_sync import WeightSyncError
from turnrl.grpo_core.weight_sync.collective import (
    CollectiveSyncConfig,
    CollectiveWeightSync,
    hf_weights,
    plan_buckets,
)
from turnrl.npu_runtime.supervise import run_group
from turnrl.rollout_router.client import EngineClient

RECEIVER = Path(__file__).with_name("collective_receiver.py")


@pytest.fixture(scope="module")
def receivers() -> Iterator[list[str]]:
    """Two stand-in receivers for the module (reset per test through ``/mode``)."""
    procs = []
    try:
        for _ in range(2):
            args = [sys.executable, str(RECEIVER), "0"]
            procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, text=True))
        urls = []
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline().split()
            assert line and line[0] == "ready", f"receiver did not start: {line}"
            urls.append(f"http://127.0.0.1:{line[1]}")
        yield urls
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
        assert all(p.poll() is not None for p in procs)


def engines(urls: list[str], **modes: tuple[object, object]) -> list[str]:
    """Reset both receivers and set their modes (one value per receiver); return the URLs.

    Modes are ``collective_receiver.Receiver``'s flags: ``reject_init``, ``stale_version``,
    ``reject_update``, ``world_size``, ``no_transfer_api``, ``record_only``,
    ``running_requests``, ``reset_declines``.
    """

    async def reset() -> None:
        for index, url in enumerate(urls):
            body = {name: values[index] for name, values in modes.items()}
            async with EngineClient(url) as client:
                await client._call("POST", "/mode", body)

    asyncio.run(reset())
    return urls


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> TorchEngine:
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", TinyModelConfig(seed=0))
    return TorchEngine(TorchEngineConfig(model_path=str(folder), seed=0))


def config(urls: list[str], **kw: object) -> CollectiveSyncConfig:
    return CollectiveSyncConfig(engine_urls=urls, backend="gloo", init_timeout_s=20.0, **kw)  # type: ignore[arg-type]


async def dump(url: str, path: Path) -> dict[str, torch.Tensor]:
    async with EngineClient(url) as client:
        await client._call("POST", "/dump", {"path": str(path)})
    return load_file(str(path))


async def received(url: str) -> dict[str, object]:
    async with EngineClient(url) as client:
        result: dict[str, object] = await client._call("GET", "/received")
    return result


def test_plan_buckets_follows_vllm_packing_rule() -> None:
    assert plan_buckets([4, 4, 4, 4], 7) == [2, 2]  # 8 > 7 closes after two
    assert plan_buckets([4, 4, 4, 4], 8) == [3, 1]  # 8 is not > 8; 12 is
    assert plan_buckets([20, 1], 5) == [1, 1]
    assert plan_buckets([], 5) == []


def test_sync_delivers_exact_weights_in_buckets_to_two_gloo_standin_engines(
    trainer: TorchEngine, receivers: list[str], tmp_path: Path
) -> None:
    two_engines = engines(receivers)
    expected = dict(hf_weights(trainer))
    sizes = [t.numel() * t.element_size() for t in expected.values()]
    bucket_mb = 0.05
    want_buckets = len(plan_buckets(sizes, int(bucket_mb * 2**20)))
    assert want_buckets > 2, "the tiny model should need several buckets"
    sync = CollectiveWeightSync(config(two_engines, bucket_mb=bucket_mb, pause_mode="keep"))

    async def run() -> tuple[dict[str, float], dict[str, float]]:
        first = await sync.sync(trainer, 1)
        with torch.no_grad():  # change the weights: the second sync must carry them
            for p in trainer.module.parameters():
                p.add_(0.5)
        second = await sync.sync(trainer, 2)
        return first, second

    first, second = asyncio.run(run())
    assert first["buckets"] == second["buckets"] == want_buckets
    assert first["bytes"] == sum(sizes)
    assert second["gb_per_s"] > 0 and second["total_s"] >= second["transfer_s"] > 0
    now = dict(hf_weights(trainer))
    for index, url in enumerate(two_engines):
        got = asyncio.run(dump(url, tmp_path / f"e{index}.safetensors"))
        assert got.keys() == now.keys()
        for name, tensor in now.items():
            assert torch.equal(got[name], tensor.cpu()), name  # the trainer may be on a GPU
        stats = asyncio.run(received(url))
        calls = stats["calls"]
        assert isinstance(calls, dict)
        assert calls["/update_weights"] == 2 * want_buckets
        assert calls["/init_weight_transfer_engine"] == 1
        assert calls["/pause"] == calls["/resume"] == 2
        assert asyncio.run(_version(url)) == "2"
    asyncio.run(sync.close())
    assert sync.group is None


async def _version(url: str) -> str | None:
    async with EngineClient(url) as client:
        return await client.weight_version()


async def _prefill(url: str, prefix: str) -> bool:
    """The receiver serves a prompt starting with ``prefix``; True on a prefix-cache hit."""
    async with EngineClient(url) as client:
        hit: bool = (await client._call("POST", "/prefill", {"prefix": prefix}))["hit"]
    return hit


SYSTEM = "system prompt + tool list"
"""The prefix every episode shares (tau's system prompt and tools)."""


def _train_one_step(engine: TorchEngine) -> None:
    """One SFT step on a fixed batch (the engine's lr moves every weight)."""
    ids = torch.arange(2 * 24).remainder(2000).add(40).view(2, 24)
    mask = torch.ones_like(ids)
    mask[:, 0] = 0
    engine.train_step(TrainBatch(ids, torch.ones_like(ids), mask), objective="sft")


@pytest.mark.parametrize("pause_mode", [None, "keep", "abort", "wait"])
def test_no_prefix_cached_with_older_weights_survives_a_sync(
    receivers: list[str], tmp_path: Path, pause_mode: str | None
) -> None:
    """vLLM clears its prefix cache only on a ``/pause`` that ends the requests (not for
    ``keep``); without a reset, the shared system prompt's KV would stay that of the first
    weights for the whole run. After each sync every engine holds the trainer's post-step
    weights, and any prefix it serves is computed with them, also with requests running
    (engine 0) and no pause at all."""
    urls = engines(receivers, running_requests=(2, 0))
    model = build_tiny_model(tmp_path / "m", TinyModelConfig(seed=0))
    trainer = TorchEngine(
        TorchEngineConfig(model_path=str(model), seed=0, optimizer=OptimizerConfig(lr=1e-3))
    )
    sync = CollectiveWeightSync(config(urls, pause_mode=pause_mode))
    asyncio.run(sync.sync(trainer, 1))
    assert [asyncio.run(_prefill(u, SYSTEM)) for u in urls] == [False, False]
    assert [asyncio.run(_prefill(u, SYSTEM)) for u in urls] == [True, True]  # cached
    before = {n: t.clone() for n, t in hf_weights(trainer)}
    _train_one_step(trainer)
    after = dict(hf_weights(trainer))
    assert all(not torch.equal(before[n], t) for n, t in after.items())  # every weight moved
    asyncio.run(sync.sync(trainer, 2))
    for index, url in enumerate(urls):
        got = asyncio.run(dump(url, tmp_path / f"e{index}.safetensors"))
        assert all(torch.equal(got[n], t) for n, t in after.items())
        stats = asyncio.run(received(url))
        cache = stats["cache"]
        assert isinstance(cache, dict)
        stale = {p: r for p, r in cache.items() if r != stats["weights_round"]}
        assert not stale, f"engine {index} keeps prefixes of older weights: {stale}"
        assert not asyncio.run(_prefill(url, SYSTEM))  # recomputed with the new weights
        log = stats["log"]
        assert isinstance(log, list)
        last_bucket = max(i for i, r in enumerate(log) if r == "/update_weights")
        resets = [i for i, r in enumerate(log) if r.startswith("/reset_prefix_cache")]
        announce = log.index("/update_weight_version", last_bucket)
        assert resets and last_bucket < resets[-1] < announce  # before the version is told
        if pause_mode is not None:
            assert resets[-1] < log.index("/resume", last_bucket)  # and before generation
        assert asyncio.run(_version(url)) == "2"
    asyncio.run(sync.close())


def test_engine_declining_the_prefix_cache_reset_fails_the_sync(
    trainer: TorchEngine, receivers: list[str]
) -> None:
    """An engine that keeps its cache (vLLM's ``{"success": false}``) must stop the run,
    named, before it is told the new version: it would serve the old weights' prefixes."""
    urls = engines(receivers, reset_declines=(False, True))
    sync = CollectiveWeightSync(config(urls))
    with pytest.raises(
        WeightSyncError, match=rf"engine {urls[1]}: reset_prefix_cache failed: .*declined"
    ):
        asyncio.run(sync.sync(trainer, 1))
    assert sync.versions == [] and asyncio.run(_version(urls[1])) is None
    asyncio.run(sync.close())


def test_sync_casts_to_configured_dtype(
    trainer: TorchEngine, receivers: list[str], tmp_path: Path
) -> None:
    urls = engines(receivers)
    sync = CollectiveWeightSync(config(urls, dtype="bfloat16"))
    metrics = asyncio.run(sync.sync(trainer, 1))
    got = asyncio.run(dump(urls[0], tmp_path / "bf16.safetensors"))
    ref = dict(hf_weights(trainer, torch.bfloat16))
    assert all(
        got[n].dtype == torch.bfloat16 and torch.equal(got[n], t.cpu()) for n, t in ref.items()
    )
    assert metrics["bytes"] == sum(t.numel() * 2 for t in ref.values())
    asyncio.run(sync.close())


def test_engine_rejecting_init_raises_weight_sync_error(
    trainer: TorchEngine, receivers: list[str]
) -> None:
    urls = engines(receivers, reject_init=(False, True))
    sync = CollectiveWeightSync(config(urls))
    with pytest.raises(WeightSyncError, match=r"init_weight_transfer_engine failed.*rejects"):
        asyncio.run(sync.sync(trainer, 1))
    assert sync.group is None and sync.versions == []


def test_engine_rejecting_a_bucket_raises_and_drops_the_group(
    trainer: TorchEngine, receivers: list[str]
) -> None:
    urls = engines(receivers, reject_update=(False, True))
    sync = CollectiveWeightSync(config(urls))
    with pytest.raises(WeightSyncError, match=r"update_weights failed.*rejects update_weights"):
        asyncio.run(sync.sync(trainer, 1))
    assert sync.group is None and sync.versions == []


def test_engine_never_confirming_version_raises(trainer: TorchEngine, receivers: list[str]) -> None:
    urls = engines(receivers, stale_version=(False, True))
    sync = CollectiveWeightSync(config(urls))
    with pytest.raises(WeightSyncError, match=rf"{urls[1]} serves weight version None, sent 3"):
        asyncio.run(sync.sync(trainer, 3))
    asyncio.run(sync.close())


def test_versions_must_increase(trainer: TorchEngine, receivers: list[str]) -> None:
    urls = engines(receivers)
    sync = CollectiveWeightSync(config(urls))
    asyncio.run(sync.sync(trainer, 5))
    with pytest.raises(ValueError, match="must increase: 5 after 5"):
        asyncio.run(sync.sync(trainer, 5))
    asyncio.run(sync.close())


def test_non_zero_rank_only_gathers_and_never_calls_engines(trainer: TorchEngine) -> None:
    sync = CollectiveWeightSync(config(["http://127.0.0.1:9"]), rank=1)  # nothing listens
    metrics = asyncio.run(sync.sync(trainer, 1))
    assert set(metrics) == {"total_s"} and sync.group is None


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"engine_urls": []}, "at least one engine url"),
        ({"backend": "mpi"}, "backend must be one of"),
        ({"backend": "hccl", "device": "cuda:0"}, "backend hccl sends from npu devices"),
        ({"backend": "nccl", "device": "npu:0"}, "backend nccl sends from cuda devices"),
        ({"backend": "gloo", "device": "cuda:0"}, "backend gloo sends from cpu devices"),
        ({"bucket_mb": 0}, "bucket_mb must be > 0"),
        ({"pause_mode": "stop"}, "pause_mode must be"),
        ({"workers_per_engine": [1, 2]}, "workers_per_engine"),
        ({"workers_per_engine": 0}, "workers_per_engine"),
        ({"init_timeout_s": 0}, "init_timeout_s"),
    ],
)
def test_config_rejects_bad_values(kw: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"engine_urls": ["http://a:1"], **kw}
    with pytest.raises(ValueError, match=match):
        CollectiveSyncConfig(**args)  # type: ignore[arg-type]


def test_engine_with_other_world_size_fails_before_any_init(
    trainer: TorchEngine, receivers: list[str]
) -> None:
    """A worker count that disagrees with the engine would hang the rendezvous: fail first."""
    urls = engines(receivers, world_size=(1, 2))
    sync = CollectiveWeightSync(config(urls))
    with pytest.raises(WeightSyncError, match=rf"{urls[1]} runs 2 workers .* gives it 1"):
        asyncio.run(sync.sync(trainer, 1))
    assert sync.group is None and sync.versions == []
    for url in urls:
        calls = asyncio.run(received(url))["calls"]
        assert isinstance(calls, dict)
        assert calls["/get_world_size"] == 1 and "/init_weight_transfer_engine" not in calls


def test_worker_counts_left_out_are_asked_of_the_engines(
    trainer: TorchEngine, receivers: list[str], tmp_path: Path
) -> None:
    """``workers_per_engine=None`` (how runs build it): each engine's ``/get_world_size``
    sets its rank offset; the weights arrive as with the counts given."""
    urls = engines(receivers)
    sync = CollectiveWeightSync(config(urls, workers_per_engine=None))
    assert sync.workers is None
    asyncio.run(sync.sync(trainer, 1))
    assert sync.workers == [1, 1]
    offsets = []
    for index, url in enumerate(urls):
        stats = asyncio.run(received(url))
        offsets.append(stats["inits"][-1]["rank_offset"])  # type: ignore[index]
        got = asyncio.run(dump(url, tmp_path / f"e{index}.safetensors"))
        for name, tensor in hf_weights(trainer):
            assert torch.equal(got[name], tensor.cpu()), name
    assert offsets == [1, 2]
    asyncio.run(sync.close())
    zero = engines(receivers, world_size=(1, 0))
    unusable = CollectiveWeightSync(config(zero, workers_per_engine=None))
    with pytest.raises(WeightSyncError, match=r"runs 0 workers"):
        asyncio.run(unusable.sync(trainer, 1))
    assert unusable.group is None


def test_engine_without_transfer_api_raises_with_the_flags_to_start_it(
    trainer: TorchEngine, receivers: list[str]
) -> None:
    urls = engines(receivers, no_transfer_api=(False, True))
    sync = CollectiveWeightSync(config(urls))
    with pytest.raises(
        WeightSyncError,
        match=rf"{urls[1]} has no weight-transfer API "
        r"\(GET /get_world_size -> HTTP 404\)",
    ):
        asyncio.run(sync.sync(trainer, 1))
    unchecked = CollectiveWeightSync(config(urls, check_world_size=False))
    with pytest.raises(WeightSyncError, match=r"POST /init_weight_transfer_engine -> HTTP 404"):
        asyncio.run(unchecked.sync(trainer, 1))
    assert sync.group is None and unchecked.group is None


def test_hccl_without_torch_npu_fails_with_a_clear_error(
    trainer: TorchEngine, receivers: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No Ascend stack here: the HCCL group must say what is missing, not crash later."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    urls = engines(receivers)
    sync = CollectiveWeightSync(CollectiveSyncConfig(engine_urls=urls, backend="hccl"))
    with pytest.raises(WeightSyncError, match=r"hccl transfer group: .*needs torch_npu"):
        asyncio.run(sync.sync(trainer, 1))
    assert sync.group is None
    for url in urls:  # the engines were checked, but nobody was asked to join
        calls = asyncio.run(received(url))["calls"]
        assert isinstance(calls, dict) and "/init_weight_transfer_engine" not in calls


def test_rank_offsets_follow_workers_per_engine() -> None:
    cfg = CollectiveSyncConfig(engine_urls=["http://a:1", "http://b:2"], workers_per_engine=[2, 3])
    assert cfg.engine_workers() == [2, 3]
    assert CollectiveSyncConfig(engine_urls=["http://a:1"], bucket_mb=1).bucket_bytes == 2**20


FSDP_WORKER = """
import asyncio, sys, torch, torch.distributed as dist
from turnrl.grpo_core.weight_sync.collective import CollectiveSyncConfig, CollectiveWeightSync
from turnrl.grpo_core.training.torch_engine import TorchEngine, TorchEngineConfig

model, out, url = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
try:
    engine = TorchEngine(TorchEngineConfig(model_path=model, seed=0))
    with torch.no_grad():
        for p in engine.module.parameters():
            p.mul_(1.5)  # on the local shard: only a full gather sees every change
    cfg = CollectiveSyncConfig(engine_urls=[url], backend="gloo", bucket_mb=0.05)
    sync = CollectiveWeightSync(cfg)
    metrics = asyncio.run(sync.sync(engine, 1))
    assert sync.rank == dist.get_rank()
    assert ("buckets" in metrics) == (sync.rank == 0), metrics
    engine.export_hf(f"{out}/export")
    asyncio.run(sync.close())
finally:
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_fsdp_two_ranks_gather_shards_and_rank_zero_sends_full_weights(
    receivers: list[str], tmp_path: Path
) -> None:
    """Two torchrun CPU ranks (FSDP2 over gloo) sync to one stand-in receiver."""
    import os

    url = engines(receivers)[0]
    model = build_tiny_model(tmp_path / "tiny", TinyModelConfig(seed=0))
    script = tmp_path / "worker.py"
    script.write_text(FSDP_WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", TURNRL_DEVICE="cpu")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(script),
        str(model),
        str(tmp_path),
        url,
    ]
    code, output = run_group(cmd, timeout=300, env=env)
    assert code == 0, output[-4000:]
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    got = asyncio.run(dump(url, tmp_path / "got.safetensors"))
    original = load_file(str(model / "model.safetensors"))
    assert got.keys() == exported.keys()
    for name, tensor in exported.items():
        assert torch.equal(got[name], tensor), name
        torch.testing.assert_close(tensor, original[name] * 1.5)
    assert asyncio.run(_version(url)) == "1"


def test_the_weight_sync_follows_the_device_and_placement(tmp_path: Path) -> None:
    """Disk on the CPU and for colocated engines; NCCL on GPUs, HCCL on NPUs, the engines
    then started with the matching transfer engine (no device needed: nothing connects)."""
    from turnrl.grpo_core.placement.plan import PlacementConfig
    from turnrl.grpo_core.placement.trainer_group import RayCollectiveSync, group_weight_sync
    from turnrl.grpo_core.weight_sync import DiskWeightSync
    from turnrl.grpo_core.weight_sync.choose import collective_backend, with_weight_transfer
    from turnrl.rollout_router.engine import EngineSpec

    assert collective_backend("cpu") is None
    assert collective_backend("gpu") == collective_backend("cuda") == "nccl"
    assert collective_backend("npu") == "hccl"
    assert collective_backend("gpu", colocate=True) is None
    spec = EngineSpec(model="m", device="gpu", dev_mode=False)
    nccl = with_weight_transfer(spec, "nccl")
    assert nccl.extra_args == ["--weight-transfer-config", '{"backend": "nccl"}'] and nccl.dev_mode
    assert with_weight_transfer(nccl, "nccl") == nccl  # not twice
    assert with_weight_transfer(spec, None) == spec
    urls = ["http://a:1", "http://b:2"]
    group: object = object()  # a trainer group: only kept, not called
    for accelerator, colocate, want in [
        ("CPU", False, None),
        ("GPU", False, "nccl"),
        ("NPU", False, "hccl"),
        ("GPU", True, None),
    ]:
        placement = PlacementConfig(
            actor_num_gpus_per_node=2,
            rollout_num_gpus=2,
            colocate=colocate,
            accelerator=accelerator,
        )
        sync = group_weight_sync(placement, group, urls, tmp_path)  # type: ignore[arg-type]
        if want is None:
            assert isinstance(sync, DiskWeightSync), accelerator
        else:
            assert isinstance(sync, RayCollectiveSync) and sync.config.backend == want
            assert sync.config.workers_per_engine is None and sync.config.engine_urls == urls
