"""Device detection: the real CPU path, and the NPU / CUDA paths with fake torch modules."""

from __future__ import annotations

import pytest

from turnrl.npu_runtime import device as dev
from turnrl.npu_runtime.device import (
    DeviceType,
    detect_device,
    device_count,
    distributed_backend,
    ray_resource_name,
    require_torch,
    resolve_device,
    set_device,
    torch_device,
    visible_devices_env,
)


@pytest.mark.parametrize(
    ("kind", "backend", "visible", "ray"),
    [
        (DeviceType.NPU, "hccl", "ASCEND_RT_VISIBLE_DEVICES", "NPU"),
        (DeviceType.CUDA, "nccl", "CUDA_VISIBLE_DEVICES", "GPU"),
        (DeviceType.CPU, "gloo", None, None),
    ],
)
def test_names_per_device(kind, backend, visible, ray):
    assert distributed_backend(kind) == kind.distributed_backend == backend
    assert visible_devices_env(kind) == kind.visible_devices_env == visible
    assert ray_resource_name(kind) == kind.ray_resource == ray
    assert kind.is_accelerator == (kind is not DeviceType.CPU)
    assert resolve_device(kind.value.upper()) is kind


def test_gpu_is_read_as_cuda():
    assert resolve_device("gpu") is resolve_device("GPU") is DeviceType.CUDA


def test_cpu_when_torch_is_missing(no_torch):
    assert detect_device() is DeviceType.CPU
    assert device_count() == 1
    assert torch_device(0) == "cpu"
    assert set_device(0) == "cpu"
    with pytest.raises(ImportError, match=r"pip install turnrl-npu-runtime\[torch\]"):
        require_torch()


def test_forcing_an_accelerator_without_torch_names_the_install(no_torch, monkeypatch):
    monkeypatch.setenv("TURNRL_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match=r"turnrl-npu-runtime\[torch\]"):
        detect_device()
    monkeypatch.setenv("TURNRL_DEVICE", "npu")
    with pytest.raises(RuntimeError, match=r"turnrl-npu-runtime\[npu\]"):
        detect_device()


def test_accelerator_queries_without_torch_raise_import_error(no_torch):
    with pytest.raises(ImportError, match="turnrl-npu-runtime"):
        device_count("cuda")


def test_real_torch_on_this_machine(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("TURNRL_DEVICE", raising=False)
    expected = DeviceType.CUDA if torch.cuda.is_available() else DeviceType.CPU
    assert detect_device() is expected  # torch_npu is never installed beside CPU torch
    assert require_torch() is torch
    assert torch.empty(2, device=torch_device(0, "cpu")).device.type == "cpu"


def test_fake_npu_is_preferred_over_cuda(fake_torch):
    torch = fake_torch(cuda=2, npu=8)
    assert detect_device() is DeviceType.NPU
    assert device_count() == 8
    assert torch_device(3) == "npu:3"
    assert torch_device() == "npu"
    assert distributed_backend() == "hccl"
    assert visible_devices_env() == "ASCEND_RT_VISIBLE_DEVICES"
    assert ray_resource_name() == "NPU"
    assert set_device(5) == "npu:5"
    assert torch.npu.set_device_calls == [5]
    assert torch.cuda.set_device_calls == []


def test_accelerator_module_per_device(fake_torch):
    torch = fake_torch(cuda=2, npu=8)
    assert dev.accelerator_module("npu") is torch.npu
    assert dev.accelerator_module("cuda") is torch.cuda
    with pytest.raises(ValueError, match="CPU has no accelerator module"):
        dev.accelerator_module("cpu")
    fake_torch(cuda=2, npu=None)
    with pytest.raises(ImportError, match="torch_npu"):
        dev.accelerator_module("npu")


def test_fake_npu_without_torch_npu_falls_back_to_cuda(fake_torch):
    fake_torch(cuda=2, npu=None)
    assert detect_device() is DeviceType.CUDA
    with pytest.raises(ImportError, match="torch_npu"):
        device_count("npu")


def test_fake_npu_present_but_unavailable_gives_cpu(fake_torch):
    fake_torch(cuda=0, npu=0)
    assert detect_device() is DeviceType.CPU


def test_fake_cuda_detection_and_set_device(fake_torch, monkeypatch):
    torch = fake_torch(cuda=2)
    assert detect_device() is DeviceType.CUDA
    assert device_count() == 2
    assert torch_device(1) == "cuda:1"
    assert set_device(1) == "cuda:1"
    assert torch.cuda.set_device_calls == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(ValueError, match=r"sees 2 cuda.*CUDA_VISIBLE_DEVICES='4,5'"):
        set_device(2)
    assert torch.cuda.set_device_calls == [1]


def test_fake_cuda_forced_to_cpu_and_back(fake_torch, monkeypatch):
    fake_torch(cuda=1)
    monkeypatch.setenv("TURNRL_DEVICE", "cpu")
    assert detect_device() is DeviceType.CPU
    monkeypatch.setenv("TURNRL_DEVICE", " CUDA ")
    assert detect_device() is DeviceType.CUDA
    monkeypatch.setenv("TURNRL_DEVICE", "auto")
    assert detect_device() is DeviceType.CUDA


def test_fake_cuda_forced_npu_is_an_error(fake_torch, monkeypatch):
    fake_torch(cuda=1)
    monkeypatch.setenv("TURNRL_DEVICE", "npu")
    with pytest.raises(RuntimeError, match="no Ascend NPU"):
        detect_device()


def test_fake_npu_forced_cuda_without_gpu_is_an_error(fake_torch, monkeypatch):
    fake_torch(cuda=0, npu=4)
    monkeypatch.setenv("TURNRL_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match=r"torch.cuda.is_available\(\) is False"):
        detect_device()


@pytest.mark.parametrize("value", ["gpu", "ascend", "cuda:0", "0"])
def test_unknown_forced_device_is_a_value_error(value, fake_torch, monkeypatch):
    fake_torch(cuda=1)
    monkeypatch.setenv(dev.DEVICE_ENV_VAR, value)
    with pytest.raises(ValueError, match=r"TURNRL_DEVICE=.*use one of npu, cuda, cpu"):
        detect_device()


def test_detect_device_reads_a_given_mapping(fake_torch):
    fake_torch(cuda=1)
    assert detect_device({"TURNRL_DEVICE": "cpu"}) is DeviceType.CPU
    assert detect_device({}) is DeviceType.CUDA


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match=">= 0"):
        torch_device(-1, "cuda")
    assert torch_device(7, "cpu") == "cpu"
