"""CollectiveWeightSync's device backends: HCCL (Ascend) and NCCL (GPU).

Here, without devices, the trainer side runs against a *mocked NPU boundary*
(``fake_npu_stack.py``: fake ``torch_npu``, vLLM ``StatelessProcessGroup`` and vllm-ascend
``PyHcclCommunicator``) in a child process, with the stand-in receivers as engines
(record-only: they check the HTTP side and join no collective), and NCCL against a fake
``libnccl``. The ``npu`` / ``gpu`` tests run the real communicators on a device machine
and skip elsewhere.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.grpo_core.weight_sync.collective import BACKENDS, CollectiveSyncConfig
from turnrl.npu_runtime import transfer as transfer_group
from turnrl.npu_runtime.transfer import HcclTransferGroup, NcclUniqueIdTransferGroup
from turnrl.rollout_router.client import EngineClient

TESTS = Path(__file__).parent
BUCKET_MB = 0.05

CHILD = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[1])
import fake_npu_stack as fakes
from turnrl.grpo_core.weight_sync import WeightSyncError
from turnrl.grpo_core.weight_sync.collective import CollectiveSyncConfig, CollectiveWeightSync
from turnrl.grpo_core.training.torch_engine import TorchEngine, TorchEngineConfig

model, urls, bucket_mb = sys.argv[2], sys.argv[3].split(","), float(sys.argv[4])
trainer = TorchEngine(TorchEngineConfig(model_path=model, seed=0))
fakes.install()  # after transformers is loaded: it would take the fake torch_npu for real
cfg = CollectiveSyncConfig(engine_urls=urls, backend="hccl", device="npu:1", bucket_mb=bucket_mb,
                           workers_per_engine=[1, 2], init_timeout_s=20.0, pause_mode="keep")
sync = CollectiveWeightSync(cfg)
metrics = asyncio.run(sync.sync(trainer, 1))
port = sync.group.master_port
asyncio.run(sync.close())
out = {"metrics": metrics, "port": port, "engine_args": cfg.engine_args(), "calls": fakes.CALLS,
       "sent": [chunk.hex() for chunk in fakes.SENT]}
fakes.HCCL_LOADS = False  # vllm-ascend cannot load libhccl: the sync must refuse, not no-op
try:
    asyncio.run(CollectiveWeightSync(cfg).sync(trainer, 2))
except WeightSyncError as exc:
    out["disabled_error"] = str(exc)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def record_only_engines() -> Iterator[list[str]]:
    """Two stand-in receivers that record bodies only; engine 2 reports 2 workers."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(TESTS / "collective_receiver.py"), "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        urls = []
        for proc, workers in zip(procs, (1, 2), strict=True):
            assert proc.stdout is not None
            line = proc.stdout.readline().split()
            assert line and line[0] == "ready", f"receiver did not start: {line}"
            urls.append(f"http://127.0.0.1:{line[1]}")
            asyncio.run(_post(urls[-1], "/mode", {"record_only": True, "world_size": workers}))
        yield urls
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


async def _post(url: str, path: str, body: dict[str, Any]) -> Any:
    async with EngineClient(url) as client:
        return await client._call("POST", path, body)


async def _get(url: str, path: str) -> Any:
    async with EngineClient(url) as client:
        return await client._call("GET", path)


@pytest.fixture(scope="module")
def hccl_run(
    record_only_engines: list[str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], Path]:
    """One child-process sync over the mocked NPU boundary; its record and the model."""
    model = build_tiny_model(tmp_path_factory.mktemp("npu") / "m", TinyModelConfig(seed=0))
    args = [
        sys.executable,
        "-c",
        CHILD,
        str(TESTS),
        str(model),
        ",".join(record_only_engines),
        str(BUCKET_MB),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TURNRL_DEVICE="cpu")
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT ")), model


def test_hccl_mocked_npu_boundary_rendezvous_matches_vllm_ascend_engine(
    hccl_run: tuple[dict[str, Any], Path], record_only_engines: list[str]
) -> None:
    """Mocked NPU boundary: the store, communicator and init bodies vllm-ascend expects."""
    run, _ = hccl_run
    calls = run["calls"]
    creates = [c for c in calls if c["call"] == "StatelessProcessGroup.create"]
    assert len(creates) == 2  # the sync, then the attempt with libhccl missing
    assert creates[0] == {
        "call": "StatelessProcessGroup.create",
        "thread": "turnrl-weight-transfer",
        "host": "127.0.0.1",
        "port": run["port"],
        "rank": 0,
        "world_size": 4,
        "store_timeout": 20,
    }
    comms = [c for c in calls if c["call"] == "PyHcclCommunicator"]
    assert [(c["rank"], c["world_size"], c["device"]) for c in comms] == [(0, 4, "npu:1")] * 2
    # the join thread selects the group's NPU before it creates the store and communicator
    first = calls.index(creates[0])
    assert calls[first - 1] == {
        "call": "set_device",
        "thread": "turnrl-weight-transfer",
        "device": "npu:1",
    }
    assert run["engine_args"] == ["--weight-transfer-config", '{"backend": "hccl"}']
    for url, offset in zip(record_only_engines, (1, 2), strict=True):
        got = asyncio.run(_get(url, "/received"))
        assert got["inits"][0] == {
            "master_address": "127.0.0.1",
            "master_port": run["port"],
            "world_size": 4,
            "rank_offset": offset,
            "packed": True,
            "packed_buffer_size_bytes": int(BUCKET_MB * 2**20),
            "packed_num_buffers": 1,
        }
        assert got["calls"]["/shutdown_weight_transfer_engine"] == 1


def test_hccl_mocked_npu_boundary_broadcasts_each_bucket_as_announced(
    hccl_run: tuple[dict[str, Any], Path], record_only_engines: list[str]
) -> None:
    """Mocked NPU boundary: every broadcast carries exactly the bucket the engines were told."""
    run, model = hccl_run
    weights = load_file(str(model / "model.safetensors"))
    limit = int(BUCKET_MB * 2**20)
    broadcasts = [c for c in run["calls"] if c["call"] == "broadcast"]
    assert broadcasts and all(b["src"] == 0 and b["on_current_stream"] for b in broadcasts)
    assert all(b["thread"] == "turnrl-weight-transfer" for b in broadcasts)
    syncs = [c for c in run["calls"] if c["call"] == "stream.synchronize"]
    assert len(syncs) == len(broadcasts)  # each buffer is out before it can be freed
    for url in record_only_engines:
        updates = asyncio.run(_get(url, "/received"))["updates"]
        assert len(updates) == len(run["sent"]) == run["metrics"]["buckets"]
        names: list[str] = []
        for index, (update, sent) in enumerate(zip(updates, run["sent"], strict=True)):
            parts = [weights[n] for n in update["names"]]
            assert update["shapes"] == [list(t.shape) for t in parts]
            assert update["dtype_names"] == [str(t.dtype).removeprefix("torch.") for t in parts]
            sizes = [math.prod(t.shape) * t.element_size() for t in parts]
            if index < len(updates) - 1:  # vLLM's packing rule: closes once it exceeds
                assert sum(sizes) > limit >= sum(sizes[:-1])
            want = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in parts)
            assert hashlib.sha256(bytes.fromhex(sent)).digest() == hashlib.sha256(want).digest()
            names += update["names"]
        assert sorted(names) == sorted(weights)
    assert run["metrics"]["bytes"] == sum(t.numel() * t.element_size() for t in weights.values())
    closes = [c for c in run["calls"] if c["call"] == "PyHcclCommunicator.close"]
    assert len(closes) == 1


def test_hccl_mocked_npu_boundary_round_resets_the_prefix_cache_before_the_version(
    hccl_run: tuple[dict[str, Any], Path], record_only_engines: list[str]
) -> None:
    """Mocked NPU boundary: vllm-ascend keeps its prefix cache through a ``keep`` pause and
    the update, so the round resets it (preempting the kept requests) once the last bucket
    is in, before the version is announced and generation resumes."""
    run, _ = hccl_run
    buckets = int(run["metrics"]["buckets"])
    for url in record_only_engines:
        log = asyncio.run(_get(url, "/received"))["log"]
        start = log.index("/pause?mode=keep")
        end = log.index("/shutdown_weight_transfer_engine")
        assert log[start:end] == [
            "/pause?mode=keep",
            "/start_weight_update",
            *["/update_weights"] * buckets,
            "/finish_weight_update",
            "/reset_prefix_cache?reset_running_requests=true",
            "/update_weight_version",
            "/resume",
        ]


def test_hccl_mocked_npu_boundary_refuses_a_disabled_communicator(
    hccl_run: tuple[dict[str, Any], Path],
) -> None:
    """Mocked NPU boundary: vllm-ascend disables PyHccl without libhccl; we must not no-op."""
    run, _ = hccl_run
    assert "libhccl could not be loaded" in run["disabled_error"]
    assert "init_weight_transfer_engine failed" in run["disabled_error"]


def _fake_module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def test_hccl_group_names_the_missing_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mocked NPU boundary: torch_npu, vLLM and vllm-ascend each missing in turn."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(RuntimeError, match=r"needs torch_npu .*cannot import torch_npu"):
        HcclTransferGroup(2)
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_module("torch_npu", npu=object()))
    monkeypatch.setitem(sys.modules, "vllm.distributed.utils", None)
    with pytest.raises(RuntimeError, match=r"needs vLLM in the trainer's environment"):
        HcclTransferGroup(2)
    fake_utils = _fake_module("vllm.distributed.utils", StatelessProcessGroup=object)
    monkeypatch.setitem(sys.modules, "vllm.distributed.utils", fake_utils)
    monkeypatch.setitem(sys.modules, "vllm_ascend.distributed.device_communicators.pyhccl", None)
    with pytest.raises(RuntimeError, match=r"needs vllm-ascend in the trainer's environment"):
        HcclTransferGroup(2)
    with pytest.raises(ValueError, match=">= 1 worker"):
        HcclTransferGroup(1)


def test_nccl_mocked_gpu_boundary_unique_id_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mocked GPU boundary (fake libnccl): the init info vLLM's NCCL engine decodes."""
    minted = bytes(range(128))

    class FakeNccl:
        def ncclGetUniqueId(self, ref: Any) -> int:
            ctypes.memmove(ctypes.addressof(ref._obj), minted, len(minted))
            return 0

    monkeypatch.setattr(transfer_group, "load_nccl", lambda path=None: FakeNccl())
    cfg = CollectiveSyncConfig(
        engine_urls=["http://a:1", "http://b:2"],
        backend="nccl",
        device="cuda:3",
        workers_per_engine=[2, 1],
    )
    group = BACKENDS["nccl"].open_group(cfg, 1 + sum(cfg.engine_workers()))
    assert isinstance(group, NcclUniqueIdTransferGroup) and group.device == torch.device("cuda:3")
    info = group.init_info()
    assert info == {"nccl_unique_id_b64": base64.b64encode(minted).decode(), "world_size": 4}
    assert cfg.engine_args() == ["--weight-transfer-config", '{"backend": "nccl"}']


def test_backend_table_pairs_engine_backend_and_device() -> None:
    assert {name: (b.engine_backend, b.device_type) for name, b in BACKENDS.items()} == {
        "nccl": ("nccl", "cuda"),
        "hccl": ("hccl", "npu"),
        "gloo": (None, "cpu"),
    }
    gloo = CollectiveSyncConfig(engine_urls=["http://a:1"], backend="gloo")
    assert gloo.engine_args() == []


def _has(*modules: str) -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except ModuleNotFoundError:
        return False


DEVICE_WORKER = """
import sys, torch
kind, port, world = sys.argv[1], int(sys.argv[2]), 2
if kind == "npu":
    import torch_npu
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm_ascend.distributed.device_communicators.pyhccl import PyHcclCommunicator
    torch.npu.set_device(1)
    comm = PyHcclCommunicator(StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=1,
                              world_size=world), device=torch.device("npu:1"))
else:
    import base64
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    torch.cuda.set_device(1)
    comm = PyNcclCommunicator.from_unique_id_bytes(base64.b64decode(sys.argv[3]), rank=1,
                                                   world_size=world, device=torch.device("cuda:1"))
buf = torch.empty(1 << 20, dtype=torch.uint8, device=f"{kind}:1")
comm.broadcast(buf, src=0)
getattr(torch, kind).synchronize()
want = torch.arange(1 << 20, dtype=torch.int64).remainder(251).to(torch.uint8)
assert torch.equal(buf.cpu(), want), "received bytes differ"
print("OK")
"""


def _device_round_trip(group: Any, kind: str, extra: list[str]) -> None:
    """Rank 1 (a vLLM-side communicator in a child) receives 1 MiB from ``group``."""
    args = [sys.executable, "-c", DEVICE_WORKER, kind, str(getattr(group, "master_port", 0))]
    child = subprocess.Popen(args + extra, stdout=subprocess.PIPE, text=True)
    try:
        group.join()
        payload = torch.arange(1 << 20, dtype=torch.int64).remainder(251).to(torch.uint8)
        group.broadcast(group.stage(payload))
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0 and "OK" in out, out
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        group.close()


@pytest.mark.npu
@pytest.mark.skipif(not _has("torch_npu", "vllm_ascend"), reason="needs torch_npu + vllm-ascend")
def test_hccl_group_broadcasts_to_a_vllm_ascend_communicator_on_npus() -> None:
    """Real HCCL on two NPUs: the trainer's group (npu:0) and a PyHccl rank 1 (npu:1)."""
    import torch_npu

    if torch_npu.npu.device_count() < 2:
        pytest.skip("needs two NPUs")
    _device_round_trip(HcclTransferGroup(2, device="npu:0", timeout_s=60), "npu", [])


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and _has("vllm")), reason="needs CUDA + vllm")
def test_nccl_group_broadcasts_to_a_vllm_communicator_on_gpus() -> None:
    """Real NCCL on two GPUs: the trainer's unique-id group and a PyNccl rank 1 (cuda:1)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    group = NcclUniqueIdTransferGroup(2, "cuda:0")
    _device_round_trip(group, "cuda", [group.init_info()["nccl_unique_id_b64"]])
