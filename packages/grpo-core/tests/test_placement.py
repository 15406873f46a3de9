"""Ray placement on a simulated two-node cluster (``ray.cluster_utils.Cluster``).

Each node has 2 CPUs; one "device" is one CPU bundle. The tests check where Ray put the
trainer and engine actors (by node id), that two trainer ranks train together over gloo
exactly like one process on the whole batch, that an engine actor's server answers a real
HTTP generation, and that a placement the cluster cannot hold fails within its timeout.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

# Before ray is imported (it reads these at import): no auth for this local cluster, and no
# `uv run` runtime env (under `uv run` Ray would package the working folder and start every
# worker through `uv run`, which costs seconds per worker).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
ray = pytest.importorskip("ray", reason="needs turnrl-grpo-core[ray]")

from ray.cluster_utils import Cluster  # noqa: E402

from turnrl.grpo_core.placement.actors import EngineLaunch, PlacementError, RayPlacement  # noqa: E402
from turnrl.grpo_core.placement.plan import PlacementConfig  # noqa: E402
from turnrl.grpo_core.training.batch import TrainBatch  # noqa: E402
from turnrl.grpo_core.training.tiny_model import build_tiny_model  # noqa: E402
from turnrl.grpo_core.training.torch_engine import (  # noqa: E402
    OptimizerConfig,
    TorchEngine,
    TorchEngineConfig,
)
from turnrl.npu_runtime.supervise import StartCancelled  # noqa: E402
from turnrl.rollout_router.client import EngineClient  # noqa: E402
from turnrl.rollout_router.engine import EngineSpec  # noqa: E402
from turnrl.rollout_router.protocol import SamplingParams  # noqa: E402
from turnrl.rollout_router.testing import ThreadedFakeEngine  # noqa: E402

pytestmark = pytest.mark.slow

ACTOR_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
CPUS_PER_NODE = 2  # conftest.CPUS_PER_NODE: the cluster fixture's nodes


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("placement") / "tiny")


def make_batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 700, (4, 16), generator=g)
    attn = torch.ones_like(ids)
    attn[3, 10:] = 0
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 5:] = 1
    return TrainBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask * attn)


def all_node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_disaggregated_trainers_and_engines_on_separate_nodes(
    cluster: Cluster, tiny_model: Path
) -> None:
    """2 trainer ranks fill one node, 2 engines the other; the ranks train as one process."""
    config = PlacementConfig(
        actor_num_gpus_per_node=2, rollout_num_gpus=2, accelerator="CPU", strategy="PACK"
    )
    engine_config = TorchEngineConfig(
        model_path=str(tiny_model), optimizer=OptimizerConfig(lr=1e-3), micro_batch_size=1
    )
    batch = make_batch()
    shards = [batch.select(slice(0, 2)), batch.select(slice(2, 4))]
    with RayPlacement(config, ready_timeout_s=60, env=ACTOR_ENV) as placement:
        placement.start_trainers(engine_config)
        urls = placement.start_engines(EngineLaunch(server=ThreadedFakeEngine))
        trainer_nodes, engine_nodes = placement.trainer_nodes, placement.engine_nodes
        metrics = [placement.trainer_call("train_step", shards, objective="sft") for _ in range(2)]
        logps = placement.trainer_call("compute_logprobs", [batch, batch])
        generated = asyncio.run(generate_from(urls))
    # Placement: each kind on its own node, the two nodes of the cluster.
    assert len(set(trainer_nodes)) == 1 and len(set(engine_nodes)) == 1
    assert set(trainer_nodes) | set(engine_nodes) == all_node_ids()
    assert trainer_nodes[0] != engine_nodes[0]
    # Both ranks report the same mini-batch loss, equal to one process on the whole batch.
    single = TorchEngine(engine_config)
    expected = [single.train_step(batch, objective="sft")["loss"] for _ in range(2)]
    for step, per_rank in enumerate(metrics):
        assert per_rank[0]["loss"] == pytest.approx(per_rank[1]["loss"], abs=1e-6)
        assert per_rank[0]["loss"] == pytest.approx(expected[step], abs=1e-5)
    # After the steps both ranks hold the same weights, and the single process's.
    torch.testing.assert_close(logps[0], logps[1])
    torch.testing.assert_close(logps[0], single.compute_logprobs(batch), atol=1e-5, rtol=1e-4)
    # Each engine served a real HTTP generation: tokens are (sum(prompt) + i) % 1000.
    assert generated == [[(6 + i) % 1000 for i in range(4)]] * 2


async def generate_from(urls: list[str]) -> list[list[int]]:
    out = []
    for url in urls:
        async with EngineClient(url) as client:
            gen = await client.generate([1, 2, 3], SamplingParams(max_tokens=4))
            out.append(list(gen.token_ids))
    return out


def test_colocated_engines_share_the_trainers_node(cluster: Cluster) -> None:
    """With colocate, engine e sits on trainer e's bundle, hence on its node."""
    config = PlacementConfig(
        actor_num_gpus_per_node=2, rollout_num_gpus=2, colocate=True, accelerator="CPU"
    )
    with RayPlacement(config, ready_timeout_s=60, env=ACTOR_ENV) as placement:
        assert placement.plan.num_bundles == 2
        placement.start_trainers()  # actors only: the engines are tested above
        urls = placement.start_engines(EngineLaunch(server=ThreadedFakeEngine))
        trainer_nodes, engine_nodes = placement.trainer_nodes, placement.engine_nodes
        generated = asyncio.run(generate_from(urls))
        free_cpus = ray.available_resources().get("CPU", 0.0)
    assert engine_nodes == trainer_nodes
    assert len(set(trainer_nodes)) == 1  # PACK puts both bundles on one node
    assert generated == [[(6 + i) % 1000 for i in range(4)]] * 2
    # Only 2 of the 4 CPUs were reserved: colocation needs no extra devices.
    assert free_cpus == pytest.approx(2 * CPUS_PER_NODE - 2)


def test_a_trainer_rank_runs_the_torch_threads_it_is_given(cluster: Cluster) -> None:
    """Ray starts a 1-CPU actor's worker with OMP_NUM_THREADS=1 and torch is imported before
    the actor is built: the rank's own OMP_NUM_THREADS must still set torch's threads (the
    CPU default's trainer ran on one of its two threads, train phase +25%)."""
    config = PlacementConfig(actor_num_gpus_per_node=1, rollout_num_gpus=1, accelerator="CPU")
    env = {**ACTOR_ENV, "OMP_NUM_THREADS": "2"}
    with RayPlacement(config, ready_timeout_s=60, env=env) as placement:
        (trainer,) = placement.start_trainers()
        info = ray.get(trainer.node_info.remote())
    assert info["torch_threads"] == 2


def test_not_enough_resources_fails_within_timeout(cluster: Cluster) -> None:
    """5 one-CPU bundles on 4 CPUs: a clear error after the timeout, nothing left reserved."""
    config = PlacementConfig(actor_num_gpus_per_node=3, rollout_num_gpus=2, accelerator="CPU")
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"did not grant 5 bundle\(s\).*CPU: 4"):
        RayPlacement(config, ready_timeout_s=3).start()
    assert time.monotonic() - start < 20
    # The unsatisfied placement group was removed: the CPUs are all free again.
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0.0) < 2 * CPUS_PER_NODE:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)


def test_strict_spread_puts_one_bundle_per_node(cluster: Cluster) -> None:
    """STRICT_SPREAD over 2 nodes: trainer and engine each get a node of their own."""
    config = PlacementConfig(rollout_num_gpus=1, accelerator="CPU", strategy="STRICT_SPREAD")
    with RayPlacement(config, ready_timeout_s=30) as placement:
        nodes = [b.node_id for b in placement.bundles]
        urls = placement.start_engines(EngineLaunch(server=ThreadedFakeEngine))
        generated = asyncio.run(generate_from(urls))
    assert sorted(nodes) == sorted(all_node_ids())
    assert generated == [[6, 7, 8, 9]]


def test_engine_server_that_dies_is_a_clear_error(cluster: Cluster, tmp_path: Path) -> None:
    """A real EngineServer launch whose process exits (no vLLM in this interpreter): the
    error names the failed step and carries the server's log tail; nothing stays reserved."""
    spec = EngineSpec(model=str(tmp_path / "no-model"), python=sys.executable, health_timeout=120)
    placement = RayPlacement(PlacementConfig(accelerator="CPU"), ready_timeout_s=30).start()
    try:
        with pytest.raises(PlacementError, match=r"engine servers start failed(.|\n)*vllm"):
            placement.start_engines(EngineLaunch(spec=spec, log_dir=str(tmp_path)))
    finally:
        placement.shutdown()
    assert placement.pg is None and placement.engines == []


def test_engines_still_starting_are_stopped_when_cancelled(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A real EngineServer launch that never serves (a stand-in "python" that sleeps; no vLLM
    needed): ``cancel`` (a run whose SFT was interrupted meanwhile) ends the wait at once,
    the busy engine actor is killed without waiting for it, and the guard of its process
    group stops the stand-in."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexec sleep 1234\n")
    python.chmod(0o755)
    spec = EngineSpec(model="m", python=str(python), health_timeout=300)
    placement = RayPlacement(PlacementConfig(accelerator="CPU"), ready_timeout_s=30).start()
    cancel = threading.Event()
    try:
        threading.Timer(3.0, cancel.set).start()
        start = time.monotonic()
        with pytest.raises(StartCancelled, match="engine servers start"):
            placement.start_engines(EngineLaunch(spec=spec, log_dir=str(tmp_path)), cancel)
        placement.shutdown(grace_s=0)
        assert time.monotonic() - start < 60  # not the 300 s health bound
    finally:
        placement.shutdown()
    assert placement.pg is None and placement.engines == []
    deadline = time.monotonic() + 30
    while _sleepers("1234"):
        assert time.monotonic() < deadline, "the engine stand-in outlived its killed actor"
        time.sleep(0.5)


def _sleepers(marker: str) -> list[int]:
    """Processes running ``sleep <marker>``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if args[:2] == [b"sleep", marker.encode()]:
                found.append(int(entry.name))
    return found


def test_shutdown_after_ray_is_gone_starts_no_new_ray(cluster: Cluster) -> None:
    """Ray shut down under a live placement (as after a Ctrl-C the whole process group got):
    its shutdown drops what it held instead of a remote call, which would start a new Ray."""
    placement = RayPlacement(PlacementConfig(accelerator="CPU"), ready_timeout_s=30).start()
    placement.start_engines(EngineLaunch(server=ThreadedFakeEngine))
    ray.shutdown()
    try:
        placement.shutdown()
        assert not ray.is_initialized()
        assert placement.pg is None and placement.engines == [] and placement.engine_urls == []
    finally:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)


def test_a_run_starts_its_own_ray_beside_another_one_on_the_machine(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another Ray runs on this machine (the fixture's cluster: the latest one started here,
    as after a user's ``ray start``) and ``RAY_ADDRESS`` is unset: the run starts a Ray of
    its own instead of joining that one (where ``ray.init`` refuses ``num_cpus``), and stops
    only its own."""
    from turnrl.grpo_core.recipe.cluster import ray_run

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    other = ray.get_runtime_context().gcs_address
    ray.shutdown()
    try:
        with ray_run(PlacementConfig(accelerator="CPU")) as job:
            assert ray.get_runtime_context().gcs_address != other
            assert ray.cluster_resources()["CPU"] == job.placement.plan.num_bundles
        assert not ray.is_initialized()
    finally:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    assert ray.get_runtime_context().gcs_address == other  # the other Ray is still up
