"""User simulators: ScriptedUser, and LiteLLMUser against a real local OpenAI-compatible server.

The server is a real aiohttp app on 127.0.0.1 answering ``/v1/chat/completions``; it can
be told to fail its first N requests (HTTP 500) and then recover.
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Any

# Before anything imports litellm: otherwise it fetches its price map from the network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import pytest

from turnrl.tool_envs.rollout import RolloutConfig, run_episode
from turnrl.tool_envs.tools import ToolEnvironment, ToolSet
from turnrl.tool_envs.user_sim import (
    STOP_TOKEN,
    LiteLLMUser,
    LiteLLMUserConfig,
    ScriptedUser,
    UserSimulatorError,
    is_stop,
)

# -- ScriptedUser --------------------------------------------------------------------------


async def test_scripted_user_replays_then_stops():
    user = ScriptedUser(["Hi, I need help.", "It is #W1."])
    assert await user.reset("You want help with #W1.") == "Hi, I need help."
    assert await user.respond("Which order?") == "It is #W1."
    assert await user.respond("Done.") == STOP_TOKEN and is_stop(STOP_TOKEN)
    assert user.transcript == [
        ("", "Hi, I need help."),
        ("Which order?", "It is #W1."),
        ("Done.", STOP_TOKEN),
    ]
    assert await user.reset("again") == "Hi, I need help."  # reset starts over


async def test_scripted_user_from_a_function():
    user = ScriptedUser(lambda msg, turn: f"{turn}:{msg.upper()}")
    assert await user.reset("x") == "0:"
    assert await user.respond("abc") == "1:ABC"


@pytest.mark.parametrize(
    ("replies", "error"), [([], ValueError), ("hello", TypeError), (["ok", 3], TypeError)]
)
def test_scripted_user_bad_scripts(replies, error):
    with pytest.raises(error):
        ScriptedUser(replies)


async def test_scripted_user_function_must_return_text():
    with pytest.raises(UserSimulatorError, match="returned int"):
        await ScriptedUser(lambda msg, turn: 3).reset("x")  # type: ignore[arg-type,return-value]


# -- LiteLLMUser against a local server ------------------------------------------------------

needs_litellm = pytest.mark.skipif(
    importlib.util.find_spec("litellm") is None or importlib.util.find_spec("aiohttp") is None,
    reason="litellm and aiohttp are not installed (pip install 'turnrl-tool-envs[litellm]' aiohttp)",
)


class FlakyServer:
    """An OpenAI-compatible chat server answering HTTP 500 to the requests numbered in ``fail``.

    ``fail`` is a set of 1-based request numbers, or an int N for the first N requests.
    """

    def __init__(
        self, fail: int | set[int] = 0, replies: tuple[str, ...] = ("I want to cancel #W1.",)
    ) -> None:
        self.fail = set(range(1, fail + 1)) if isinstance(fail, int) else fail
        self.replies = replies
        self.requests: list[dict[str, Any]] = []

    async def handle(self, request):
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        if len(self.requests) in self.fail:
            return web.json_response({"error": {"message": "overloaded"}}, status=500)
        served = sum(1 for n in range(1, len(self.requests)) if n not in self.fail)
        text = self.replies[min(served, len(self.replies) - 1)]
        return web.json_response(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": text},
                    }
                ],
                "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110},
            }
        )


def user_config(api_base: str, **kw) -> LiteLLMUserConfig:
    defaults: dict[str, Any] = {
        "model": "openai/user-model",
        "api_base": api_base,
        "backoff_s": 0.01,
        "max_retries": 3,
    }
    return LiteLLMUserConfig(**{**defaults, **kw})


@needs_litellm
async def test_litellm_user_retries_then_recovers(serve):
    server = FlakyServer(fail=2, replies=("Hi, I want to cancel #W1.", "Yes. ###STOP###"))
    user = LiteLLMUser(user_config(await serve(server), backoff_s=0.05))
    start = time.perf_counter()
    first = await user.reset("You are Ana. Cancel order #W1 because you no longer need it.")
    assert first == "Hi, I want to cancel #W1."
    assert time.perf_counter() - start >= 0.05 + 0.1  # two backoffs: 0.05 then 0.1 s
    assert len(server.requests) == 3  # two failures and a success, no hidden client retries
    system = server.requests[-1]["messages"][0]
    assert system["role"] == "system" and "Cancel order #W1" in system["content"]
    assert STOP_TOKEN in system["content"] and server.requests[-1]["model"] == "user-model"
    reply = await user.respond("Do you confirm the cancellation?")
    assert is_stop(reply)
    sent = server.requests[-1]["messages"]
    # roles are flipped for the user model: the agent speaks as "user", the simulated user as "assistant"
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[-1]["content"] == "Do you confirm the cancellation?"
    usage = user.usage
    assert (usage.calls, usage.failed_calls) == (2, 2)
    assert (usage.prompt_tokens, usage.completion_tokens) == (200, 20)


@needs_litellm
async def test_litellm_user_gives_up_with_a_clear_error(serve):
    server = FlakyServer(fail=100)
    user = LiteLLMUser(user_config(await serve(server), max_retries=2))
    with pytest.raises(UserSimulatorError, match="failed after 3 tries"):
        await user.reset("anything")
    assert len(server.requests) == 3 and user.usage.failed_calls == 3


@needs_litellm
async def test_litellm_user_on_a_dead_port_gives_up_after_its_retries():
    """A user simulator whose server is down (connection refused): bounded retries, then a
    clear error the episode turns into a failed (not scored) episode."""
    from turnrl.npu_runtime.net import free_port

    user = LiteLLMUser(user_config(f"http://127.0.0.1:{free_port()}/v1", max_retries=1))
    with pytest.raises(UserSimulatorError, match="failed after 2 tries"):
        await user.reset("anything")
    assert user.usage.failed_calls == 2


@needs_litellm
async def test_litellm_user_cost_from_the_local_price_map(serve):
    import litellm

    server = FlakyServer()
    user = LiteLLMUser(user_config(await serve(server), model="openai/gpt-4o-mini"))
    await user.reset("x")
    await user.respond("y")
    price = litellm.model_cost["gpt-4o-mini"]
    expected = 2 * (100 * price["input_cost_per_token"] + 10 * price["output_cost_per_token"])
    assert user.usage.cost_usd == pytest.approx(expected)
    assert user.usage.cost_usd > 0


@needs_litellm
async def test_litellm_user_bad_use():
    with pytest.raises(ValueError, match="model must be"):
        LiteLLMUserConfig(model="")
    with pytest.raises(ValueError, match="max_retries"):
        LiteLLMUserConfig(model="openai/x", max_retries=-1)
    with pytest.raises(ValueError, match="backoff"):
        LiteLLMUserConfig(model="openai/x", backoff_s=-1)
    with pytest.raises(ValueError, match="instruction"):
        LiteLLMUserConfig(model="openai/x", system_prompt="no placeholder")
    with pytest.raises(UserSimulatorError, match="before reset"):
        await LiteLLMUser(LiteLLMUserConfig(model="openai/x")).respond("hi")


def test_user_config_retries_from_environment(monkeypatch):
    monkeypatch.setenv("TAU_USER_LITELLM_RETRIES", "5")
    assert LiteLLMUserConfig.from_env("openai/x", backoff_s=2.0).max_retries == 5
    monkeypatch.setenv("TAU_USER_LITELLM_RETRIES", "-1")
    with pytest.raises(ValueError, match="max_retries must be >= 0"):
        LiteLLMUserConfig.from_env("openai/x")
    monkeypatch.setenv("TAU_USER_LITELLM_RETRIES", "many")
    with pytest.raises(ValueError, match="TAU_USER_LITELLM_RETRIES must be an integer"):
        LiteLLMUserConfig.from_env("openai/x")
    monkeypatch.delenv("TAU_USER_LITELLM_RETRIES")
    assert LiteLLMUserConfig.from_env("openai/x", max_retries=1).max_retries == 1


@needs_litellm
async def test_episode_with_an_unreachable_user_fails_cleanly(qwen3, make_engine, serve):
    # the first reply succeeds on its retry; the next one fails both its tries
    server = FlakyServer(fail={1, 3, 4}, replies=("Where is my order?",))
    user = LiteLLMUser(user_config(await serve(server), max_retries=1))
    env = ToolEnvironment(ToolSet(), user, "You are an agent.")
    engine = make_engine(["Which order?"])
    t = await run_episode(engine, env, qwen3, {"instruction": "Find your order."}, RolloutConfig())
    assert t.status == "failed" and "UserSimulatorError" in t.metadata["error"]
    assert t.messages[1] == {"role": "user", "content": "Where is my order?"}
    assert t.num_turns == 1 and len(server.requests) == 4


@needs_litellm
async def test_episode_reports_the_user_models_usage(qwen3, make_engine, serve):
    server = FlakyServer(fail={2}, replies=("Where is my order?", "Thanks! ###STOP###"))
    user = LiteLLMUser(user_config(await serve(server), max_retries=2))
    env = ToolEnvironment(ToolSet(), user, "You are an agent.")
    t = await run_episode(
        make_engine(["It shipped."]), env, qwen3, {"instruction": "Ask."}, RolloutConfig()
    )
    assert t.status == "completed" and t.messages[-1]["content"] == "Thanks! ###STOP###"
    usage = t.metadata["env_info"]["user_usage"]
    assert (usage["calls"], usage["failed_calls"]) == (2, 1)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (200, 20)
