"""Fixtures shared by grpo-core's tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

CPUS_PER_NODE = 2
"""CPUs of each node of the simulated Ray cluster."""


def start_cluster(attempts: int = 2) -> Any:
    """Two Ray nodes on this machine; one retry, as Ray gives a raylet a fixed 30 s to
    register (a loaded machine can miss that)."""
    from ray.cluster_utils import Cluster

    node_args = {"num_cpus": CPUS_PER_NODE, "object_store_memory": 100 * 1024**2}
    for attempt in range(1, attempts + 1):
        c = Cluster(initialize_head=False)
        try:
            c.add_node(**node_args, include_dashboard=False)  # the first node is the head
            c.add_node(**node_args)
            c.wait_for_nodes()
            return c
        except Exception:
            c.shutdown()
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Two Ray nodes on this machine (``ray.cluster_utils.Cluster``), 2 CPUs each, small
    object stores, with this process connected as the driver."""
    # Before ray is imported (it reads these at import): no auth for this local cluster, and
    # no `uv run` runtime env (under `uv run` Ray would package the working folder and start
    # every worker through `uv run`, which costs seconds per worker).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ray = pytest.importorskip("ray", reason="needs turnrl-grpo-core[ray]")
    c = start_cluster()
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
