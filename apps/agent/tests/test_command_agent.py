"""The ``--agent-command`` path: a tiny Python script as the agent (no engine, no gateway)."""

from __future__ import annotations

import sys
import time

import pytest
from turnrl_app_agent.agents import AgentError, Endpoint, load_agent
from turnrl_app_agent.config import AgentSettings

ENDPOINT = Endpoint("http://gw/sessions/s/v1", "sk-key", "http://gw/sessions/s", "policy")
SCRIPT = """
import json, os, sys
task = json.loads(os.environ["TURNRL_TASK"])
env = {k: os.environ[k] for k in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL",
                                  "ANTHROPIC_API_KEY", "TURNRL_MODEL")}
print("some log line")
mode = task["mode"]
if mode == "fail":
    sys.exit("boom")
if mode == "silent":
    print("done")
elif mode == "text":
    print(json.dumps({"reward": "high"}))
elif mode == "sleep":
    import time; time.sleep(30)
elif env != task["expect"]:
    sys.exit(f"environment {env}")
else:
    print(json.dumps({"reward": task["x"]}))
"""


def agent_for(tmp_path, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    script = tmp_path / "agent.py"
    script.write_text(SCRIPT)
    command = f"{sys.executable} {script}"
    return load_agent(AgentSettings(agent_command=command, agent_timeout=timeout))


async def test_the_reward_is_the_last_stdout_line_and_the_endpoint_is_in_the_env(tmp_path) -> None:  # type: ignore[no-untyped-def]
    agent = agent_for(tmp_path)
    expect = {
        "OPENAI_BASE_URL": ENDPOINT.base_url,
        "OPENAI_API_KEY": "sk-key",
        "ANTHROPIC_BASE_URL": ENDPOINT.anthropic_base_url,
        "ANTHROPIC_API_KEY": "sk-key",
        "TURNRL_MODEL": "policy",
    }
    assert await agent({"mode": "ok", "x": 0.75, "expect": expect}, ENDPOINT) == 0.75


async def test_a_failing_or_silent_command_fails_the_episode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    agent = agent_for(tmp_path)
    with pytest.raises(AgentError, match="exited with 1: boom"):
        await agent({"mode": "fail"}, ENDPOINT)
    with pytest.raises(AgentError, match=r'no \{"reward": <number>\} last line: done'):
        await agent({"mode": "silent"}, ENDPOINT)
    with pytest.raises(AgentError, match=r"no .* last line: {\"reward\": \"high\"}"):
        await agent({"mode": "text"}, ENDPOINT)


async def test_a_command_past_its_timeout_is_killed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    agent = agent_for(tmp_path, timeout=1.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        await agent({"mode": "sleep"}, ENDPOINT)
    assert time.monotonic() - start < 10
