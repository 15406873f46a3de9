"""How the Ray run's engines on one host share its cores: each engine numbered on its node
(``placement.actors.node_slots``), and what ``EngineServer`` launches a numbered engine
with (``rollout_router.engine.cpu_layout``). Starting them for real is the engine-cpu
session's smoke runs."""

from __future__ import annotations

import dataclasses

import pytest

from turnrl.grpo_core.placement.actors import node_slots
from turnrl.rollout_router.engine import EngineSpec, cpu_layout


def test_engines_are_numbered_per_node_for_their_cores() -> None:
    assert node_slots(["a", "b", "a", "a"]) == [(0, 3), (0, 1), (1, 3), (2, 3)]
    assert node_slots([]) == []


def test_numbered_cpu_engines_get_cores_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    spec = EngineSpec(model="m", device="cpu")
    two = [dataclasses.replace(spec, cpu_slot=(i, 2)) for i in range(2)]
    # On a host of 5 cores: the API servers share the first core; each engine's workers
    # get two of their own.
    laid_out = [cpu_layout(s, cores=range(5))[0] for s in two]
    assert [(s.api_server_cores, s.cpu_threads_bind) for s in laid_out] == [
        ("0", "1,2"),
        ("0", "3,4"),
    ]
    # Five engines on five cores: the servers keep core 0, the engines share the others.
    five = [dataclasses.replace(spec, cpu_slot=(i, 5)) for i in range(5)]
    laid_out = [cpu_layout(s, cores=range(5))[0] for s in five]
    assert [s.cpu_threads_bind for s in laid_out] == ["1", "2", "3", "4", "1"]
    assert {s.api_server_cores for s in laid_out} == {"0"}
