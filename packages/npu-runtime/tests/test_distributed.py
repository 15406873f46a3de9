"""init_distributed: real gloo process groups on CPU; hccl / nccl with fake torch modules."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from turnrl.npu_runtime.device import DeviceType
from turnrl.npu_runtime.distributed import destroy_distributed, init_distributed

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


@pytest.fixture
def clean_launcher_env(monkeypatch):
    for name in (*LAUNCHER_VARS, "TURNRL_DEVICE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def real_torch(clean_launcher_env):
    torch = pytest.importorskip("torch")
    yield torch
    destroy_distributed()


def test_gloo_world_of_one_explicit(real_torch, port):
    ctx = init_distributed(
        rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, device="cpu"
    )
    dist = real_torch.distributed
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert (ctx.rank, ctx.world_size, ctx.local_rank) == (0, 1, 0)
    assert (ctx.device, ctx.backend, ctx.torch_device) == (DeviceType.CPU, "gloo", "cpu")
    t = real_torch.tensor([3.0])
    dist.all_reduce(t)
    assert t.item() == 3.0
    again = init_distributed(device="cpu")  # already initialised: same group, no error
    assert again == ctx
    destroy_distributed()
    assert not dist.is_initialized()
    destroy_distributed()  # twice is fine


def test_gloo_from_launcher_env(real_torch, port, monkeypatch):
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ctx = init_distributed(device="cpu")
    assert real_torch.distributed.get_world_size() == 1
    assert ctx.backend == "gloo" and ctx.rank == 0


WORKER = """
import sys, torch
from turnrl.npu_runtime.distributed import init_distributed, destroy_distributed
ctx = init_distributed(device="cpu", timeout_s=60)
t = torch.tensor([float(ctx.rank + 1)])
torch.distributed.all_reduce(t)
print(ctx.rank, ctx.world_size, ctx.backend, int(t.item()), flush=True)
destroy_distributed()
"""


@pytest.mark.slow
def test_two_processes_all_reduce_over_gloo(real_torch, port, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    procs = []
    for rank in range(2):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                stdout=subprocess.PIPE,
                text=True,
                env={**_base_env(), **env},
            )
        )
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0
            outputs.append(out.split())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sorted(outputs) == [["0", "2", "gloo", "3"], ["1", "2", "gloo", "3"]]


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}


def test_missing_launcher_env_is_named(real_torch):
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT is not set"):
        init_distributed(device="cpu")


def test_non_integer_launcher_env(real_torch, monkeypatch):
    env = {"RANK": "zero", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="RANK='zero' is not an integer"):
        init_distributed(device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 0, "world_size": 1}, "all of rank, world_size"),
        ({"rank": 2, "world_size": 2, "master_addr": "h", "master_port": 1}, r"\[0, 2\)"),
        ({"rank": 0, "world_size": 0, "master_addr": "h", "master_port": 1}, "world_size"),
        ({"rank": 0, "world_size": 1, "master_addr": "h", "master_port": 70000}, "master_port"),
        (
            {"rank": 0, "world_size": 1, "master_addr": "h", "master_port": 1, "local_rank": -1},
            "local_rank",
        ),
    ],
)
def test_bad_arguments(real_torch, kwargs, match):
    with pytest.raises(ValueError, match=match):
        init_distributed(device="cpu", **kwargs)
    assert not real_torch.distributed.is_initialized()


def test_without_torch_names_the_extra(no_torch):
    with pytest.raises(ImportError, match=r"turnrl-npu-runtime\[torch\]"):
        init_distributed(rank=0, world_size=1, master_addr="h", master_port=1)


def test_fake_npu_init_uses_hccl_and_sets_local_device(fake_torch, clean_launcher_env, monkeypatch):
    torch = fake_torch(cuda=0, npu=8)
    monkeypatch.setenv("LOCAL_RANK", "5")
    ctx = init_distributed(rank=13, world_size=16, master_addr="10.0.0.1", master_port=29500)
    call = torch.distributed.init_calls[-1]
    assert call["backend"] == "hccl"
    assert call["init_method"] == "tcp://10.0.0.1:29500"
    assert (call["rank"], call["world_size"]) == (13, 16)
    assert call["timeout"].total_seconds() == 1800
    assert torch.npu.set_device_calls == [5]
    assert (ctx.device, ctx.torch_device, ctx.local_rank) == (DeviceType.NPU, "npu:5", 5)


def test_fake_cuda_init_from_env_derives_local_rank(fake_torch, clean_launcher_env, monkeypatch):
    torch = fake_torch(cuda=4)
    env = {"RANK": "6", "WORLD_SIZE": "8", "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ctx = init_distributed(timeout_s=60)
    call = torch.distributed.init_calls[-1]
    assert (call["backend"], call["init_method"]) == ("nccl", "env://")
    assert ctx.local_rank == 6 % 4 and torch.cuda.set_device_calls == [2]
    assert ctx.torch_device == "cuda:2"
    # A second call returns the existing group's context.
    assert init_distributed() == ctx
    assert len(torch.distributed.init_calls) == 1


def test_fake_cuda_local_rank_beyond_devices_is_an_error(fake_torch, clean_launcher_env):
    torch = fake_torch(cuda=2)
    with pytest.raises(ValueError, match="out of range"):
        init_distributed(rank=0, world_size=4, local_rank=3, master_addr="h", master_port=1)
    assert torch.distributed.init_calls == []
