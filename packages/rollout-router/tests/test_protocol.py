"""The engine records and their vLLM form."""

from __future__ import annotations

import pytest

from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.protocol import SamplingParams, sampling_to_vllm


def test_sampling_converts_field_by_field():
    sampling = SamplingParams(
        temperature=0.0, top_p=0.9, max_tokens=4, stop=["\n"], stop_token_ids=[7], seed=11
    )
    assert sampling_to_vllm(sampling) == {
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


async def test_client_sends_the_seed(make_engine):
    engine = await make_engine()
    async with EngineClient(engine.url) as client:
        gen = await client.generate([1, 1], SamplingParams(max_tokens=4, seed=11), "s")
    assert gen.token_ids == [2, 3, 4, 5]
    assert engine.requests[0]["sampling_params"]["seed"] == 11


def test_allowed_token_ids_reach_the_engine_and_are_checked():
    body = sampling_to_vllm(SamplingParams(max_tokens=2, allowed_token_ids=[100, 101]))
    assert body["allowed_token_ids"] == [100, 101]
    assert "allowed_token_ids" not in sampling_to_vllm(SamplingParams())
    with pytest.raises(ValueError, match="allowed_token_ids must be non-negative integers"):
        SamplingParams(allowed_token_ids=[3, -1])
