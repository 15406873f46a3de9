"""Our records match turnrl.tool_envs' protocol by field name (checked from its source)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.protocol import Generation, SamplingParams, sampling_to_vllm

TOOL_ENVS_PROTOCOL = (
    Path(__file__).resolve().parents[2]
    / "tool-envs"
    / "src"
    / "turnrl"
    / "tool_envs"
    / "protocol.py"
)


def _fields(tree: ast.Module, cls: str) -> list[str]:
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return [
        s.target.id
        for s in node.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    ]


@pytest.mark.skipif(not TOOL_ENVS_PROTOCOL.is_file(), reason="tool-envs sources not present")
def test_fields_cover_tool_envs_protocol():
    tree = ast.parse(TOOL_ENVS_PROTOCOL.read_text())
    ours = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(_fields(tree, "SamplingParams")) <= ours
    ours = {f.name for f in dataclasses.fields(Generation)}
    assert set(_fields(tree, "Generation")) <= ours


@dataclasses.dataclass
class ForeignSampling:
    """Stands for another package's SamplingParams: same fields, different class."""

    temperature: float = 0.0
    top_p: float = 0.9
    max_tokens: int = 4
    stop: list[str] = dataclasses.field(default_factory=lambda: ["\n"])
    stop_token_ids: list[int] = dataclasses.field(default_factory=lambda: [7])
    seed: int | None = 11


def test_foreign_sampling_object_converts_field_by_field():
    body = sampling_to_vllm(ForeignSampling())
    assert body == {
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": -1,
        "max_tokens": 4,
        "logprobs": 0,
        "ignore_eos": False,
        "skip_special_tokens": False,
        "stop": ["\n"],
        "stop_token_ids": [7],
        "seed": 11,
    }


async def test_client_accepts_foreign_sampling(make_engine):
    engine = await make_engine()
    async with EngineClient(engine.url) as client:
        gen = await client.generate([1, 1], ForeignSampling(), "s")
    assert gen.token_ids == [2, 3, 4, 5]
    assert engine.requests[0]["sampling_params"]["seed"] == 11


def test_allowed_token_ids_reach_the_engine_and_are_checked():
    body = sampling_to_vllm(SamplingParams(max_tokens=2, allowed_token_ids=[100, 101]))
    assert body["allowed_token_ids"] == [100, 101]
    assert "allowed_token_ids" not in sampling_to_vllm(SamplingParams())
    with pytest.raises(ValueError, match="allowed_token_ids must be non-negative integers"):
        SamplingParams(allowed_token_ids=[3, -1])
