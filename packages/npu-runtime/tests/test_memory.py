"""Memory queries: the real host path, and NPU / CUDA paths with fake torch modules."""

from __future__ import annotations

import os

import pytest

from turnrl.npu_runtime import memory
from turnrl.npu_runtime.memory import (
    InsufficientMemoryError,
    MemoryInfo,
    check_memory_margin,
    format_bytes,
    host_memory_info,
    memory_info,
)

SAMPLE = """MemTotal:       24576000 kB
MemFree:         1000000 kB
MemAvailable:   20000000 kB
Buffers:           10000 kB
Cached:          5000000 kB
HugePages_Total:       0
"""


def test_parse_meminfo():
    assert memory._parse_meminfo(SAMPLE) == (20000000 * 1024, 24576000 * 1024)
    old_kernel = SAMPLE.replace("MemAvailable:   20000000 kB\n", "")
    assert memory._parse_meminfo(old_kernel) == (
        (1000000 + 10000 + 5000000) * 1024,
        24576000 * 1024,
    )
    with pytest.raises(ValueError, match="MemTotal"):
        memory._parse_meminfo("MemFree: 1 kB\n")


def test_host_memory_is_real_and_consistent():
    info = host_memory_info()
    assert info.device == "cpu"
    assert 0 < info.free_bytes <= info.total_bytes
    assert info.used_bytes == info.total_bytes - info.free_bytes
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert abs(info.total_bytes - physical) <= 0.01 * physical


def test_host_memory_without_proc_uses_sysconf(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "_MEMINFO", tmp_path / "no-such-meminfo")
    info = host_memory_info()
    assert info.total_bytes == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < info.free_bytes <= info.total_bytes


def test_cpu_margin_check_passes_and_fails(no_torch):
    info = check_memory_margin(0)
    assert isinstance(info, MemoryInfo) and info.device == "cpu"
    too_much = info.total_bytes + 1
    with pytest.raises(InsufficientMemoryError, match="--train-memory-margin-bytes") as err:
        check_memory_margin(too_much)
    assert err.value.margin_bytes == too_much
    assert err.value.info.free_bytes < too_much


@pytest.mark.parametrize(
    ("margin", "match"), [(-1, ">= 0"), (1.5, "integer"), (True, "integer"), ("4GiB", "integer")]
)
def test_bad_margin(margin, match):
    with pytest.raises(ValueError, match=match):
        check_memory_margin(margin, "cpu")


def test_fake_cuda_memory_of_current_and_given_device(fake_torch):
    torch = fake_torch(cuda=4)
    torch.cuda.free, torch.cuda.total = 10 << 30, 80 << 30
    torch.cuda.current = 2
    assert memory_info() == MemoryInfo(10 << 30, 80 << 30, "cuda:2")
    assert memory_info(index=3).device == "cuda:3"
    assert check_memory_margin(4 << 30).free_bytes == 10 << 30
    with pytest.raises(InsufficientMemoryError, match=r"10.00 GiB .* on cuda:2.*16.00 GiB"):
        check_memory_margin(16 << 30)


def test_fake_npu_memory(fake_torch):
    torch = fake_torch(cuda=0, npu=8)
    torch.npu.free, torch.npu.total = 3 << 30, 64 << 30
    assert memory_info() == MemoryInfo(3 << 30, 64 << 30, "npu:0")
    with pytest.raises(InsufficientMemoryError, match="npu:0"):
        check_memory_margin(4 << 30)


def test_fake_npu_memory_without_torch_npu_is_an_import_error(fake_torch):
    fake_torch(cuda=1, npu=None)
    with pytest.raises(ImportError, match="torch_npu"):
        memory_info("npu")


def test_format_bytes():
    assert format_bytes(4294967296) == "4.00 GiB (4294967296 bytes)"
    assert format_bytes(512) == "512.00 B (512 bytes)"
    assert format_bytes(3 << 40) == "3.00 TiB (3298534883328 bytes)"
