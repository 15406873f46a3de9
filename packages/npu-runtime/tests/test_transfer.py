"""The weight-transfer communicators: argument checks and a real gloo broadcast (CPU)."""

from __future__ import annotations

import datetime
import threading

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from turnrl.npu_runtime.transfer import (  # noqa: E402
    NcclUniqueIdTransferGroup,
    TorchTransferGroup,
    load_nccl,
)


def test_transfer_groups_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="gloo or nccl"):
        TorchTransferGroup("mpi", 2)
    with pytest.raises(ValueError, match=">= 1 worker"):
        TorchTransferGroup("gloo", 1)
    group = TorchTransferGroup("gloo", 2)
    assert group.init_info()["master_port"] > 0 and group.init_info()["world_size"] == 2
    with pytest.raises(RuntimeError, match="join"):
        group.broadcast(torch.zeros(1))
    group.close()
    with pytest.raises(RuntimeError, match="closed"):
        group.join()
    with pytest.raises(ValueError, match="needs a cuda device"):
        NcclUniqueIdTransferGroup(2, "cpu")
    with pytest.raises(RuntimeError, match="TURNRL_NCCL_LIBRARY"):
        load_nccl("/nonexistent/libnccl.so.2")


def test_gloo_group_broadcasts_to_a_worker_that_joins_its_store() -> None:
    """Rank 0 hosts the store; a worker joins with plain ``torch.distributed`` (as an
    engine's worker does) and receives every broadcast tensor bit for bit."""
    sent = [torch.randn(3, 4), torch.arange(7, dtype=torch.int64)]
    group = TorchTransferGroup("gloo", 2, timeout_s=60)
    info = group.init_info()
    received: list[torch.Tensor] = []

    def worker() -> None:
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore(
            info["master_address"], info["master_port"], 2, is_master=False, timeout=timeout
        )
        pg = dist.ProcessGroupGloo(dist.PrefixStore("turnrl_weight_transfer", store), 1, 2, timeout)
        for tensor in sent:
            buffer = torch.empty_like(tensor)
            pg.broadcast([buffer], dist.BroadcastOptions()).wait()
            received.append(buffer)

    thread = threading.Thread(target=worker)
    thread.start()
    group.join()
    for tensor in sent:
        group.broadcast(group.stage(tensor))
    thread.join(timeout=60)
    group.close()
    assert not thread.is_alive()
    assert [r.tolist() for r in received] == [s.tolist() for s in sent]
