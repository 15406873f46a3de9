"""The ReTool environment with a real sandbox server (and a full episode through run_episode)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from turnrl.npu_runtime.net import free_port
from turnrl.tool_envs.protocol import Environment
from turnrl.tool_envs.retool.env import (
    CODE_INTERPRETER,
    RetoolConfig,
    RetoolEnv,
    SandboxUnavailableError,
    format_run,
    last_boxed,
    problem_text,
    truncate_chars,
)
from turnrl.tool_envs.rollout import RolloutConfig, run_episode
from turnrl.tool_envs.sandbox import RunResult, SandboxClient, SandboxClientConfig
from turnrl.tool_envs.sandbox.embedded import (
    TEST_SERVER_ARGS,
    EmbeddedSandbox,
    sandbox_processes,
    shared_sandbox,
)
from turnrl.tool_envs.tool_calls import ToolCall, render_tool_call, to_openai_tool_calls

linux_only = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="Linux only")


@pytest.fixture(scope="module")
def sandbox():
    """One server for all sandbox test modules (started once, stopped at exit)."""
    return shared_sandbox(*TEST_SERVER_ARGS)


@pytest.fixture
def client(sandbox):
    client = SandboxClient(SandboxClientConfig(url=sandbox.url))
    yield client
    client.close()


def code_turn(*codes: str, content: str = "Let me compute.") -> dict:
    calls = [ToolCall("code_interpreter", {"code": c}) for c in codes]
    return {"role": "assistant", "content": content, "tool_calls": to_openai_tool_calls(calls)}


def test_truncate_keeps_head_and_tail_with_a_marker():
    text = "A" * 500 + "B" * 500
    cut = truncate_chars(text, 200)
    assert len(cut) <= 200
    assert cut.startswith("A") and cut.endswith("B")
    assert "characters truncated" in cut
    assert truncate_chars("short", 200) == "short"


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("no box here", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_last_boxed(text, answer):
    assert last_boxed(text) == answer


def test_problem_text_accepts_dataset_shapes_and_rejects_others():
    assert problem_text("2+2?") == "2+2?"
    assert problem_text({"problem": "p"}) == "p"
    assert problem_text({"Problem": "P", "Answer": 3}) == "P"
    with pytest.raises(TypeError, match="ReTool task"):
        problem_text({"answer": 1})


@pytest.mark.parametrize(
    "kwargs", [{"max_turns": 0}, {"max_tool_output_chars": 10}, {"run_timeout": 0}]
)
def test_bad_config_is_refused(kwargs):
    with pytest.raises(ValueError):
        RetoolConfig(**kwargs)


def test_format_run_never_hides_a_failure():
    down = format_run(RunResult("connection_error", message="refused"), 1000)
    assert down.startswith("Error: the code interpreter is unavailable (connection_error)")
    silent = format_run(RunResult("success"), 1000)
    assert "printed nothing" in silent
    slow = format_run(RunResult("timeout", stdout="partial\n", message="time limit exceeded"), 1000)
    assert "partial" in slow and "timed out" in slow
    both = format_run(RunResult("failed", stdout="a\n", stderr="Traceback...\n"), 1000)
    assert both == "a\nTraceback..."


@linux_only
async def test_episode_with_code_then_answer(client):
    env = RetoolEnv(client)
    assert isinstance(env, Environment)
    assert env.tools == [CODE_INTERPRETER]
    messages = await env.reset({"problem": "What is 2**10?", "answer": "1024"})
    assert messages[-1]["role"] == "user" and "2**10" in messages[-1]["content"]
    assert "\\boxed{}" in messages[-1]["content"]

    turn = code_turn("print(2**10)", "import sympy\nprint(sympy.factorint(1024))")
    result = await env.step(turn)
    assert not result.done
    assert [m["content"] for m in result.observations] == ["1024", "{2: 10}"]
    assert [m["tool_call_id"] for m in result.observations] == [c["id"] for c in turn["tool_calls"]]
    assert result.info["num_tool_calls"] == 2 and result.info["num_turns"] == 1

    final = await env.step({"role": "assistant", "content": "So it is \\boxed{1024}."})
    assert final.done and final.observations == []
    assert final.info["final_answer"] == "1024"
    assert final.info["done_reason"] == "answered"
    assert (
        final.info["num_turns"],
        final.info["num_tool_calls"],
        final.info["num_tool_errors"],
    ) == (2, 2, 0)
    with pytest.raises(RuntimeError, match="over"):
        await env.step({"role": "assistant", "content": "again"})


@linux_only
async def test_errors_timeouts_and_invalid_calls_are_shown_and_counted(client):
    env = RetoolEnv(client, RetoolConfig(run_timeout=0.5, max_tool_output_chars=300))
    await env.reset("p")
    bad = {
        "role": "assistant",
        "content": "",
        "tool_calls": to_openai_tool_calls(
            [ToolCall("code_interpreter", {"source": "1"}), ToolCall("calculator", {"code": "1"})]
        ),
        "tool_call_errors": ["Tool call is not valid JSON"],
    }
    result = await env.step(bad)
    texts = [m["content"] for m in result.observations]
    assert texts[0] == "Error: Tool call is not valid JSON"
    assert "missing required argument 'code'" in texts[1]
    assert "unknown tool 'calculator'" in texts[2]
    assert result.info["num_invalid_tool_calls"] == 3

    result = await env.step(code_turn("print('x' * 5000)", "while True: pass", "1/0"))
    long, slow, crash = (m["content"] for m in result.observations)
    assert len(long) <= 300 and "characters truncated" in long
    assert "timed out" in slow
    assert "ZeroDivisionError" in crash
    assert (
        result.info["num_tool_errors"] == 3
    )  # the three invalid calls; code that ran is not an error
    assert result.info["sandbox_statuses"] == {"success": 1, "timeout": 1, "failed": 1}


@linux_only
async def test_max_turns_ends_the_episode(client):
    env = RetoolEnv(client, RetoolConfig(max_turns=1))
    await env.reset("p")
    result = await env.step(code_turn("print(1)"))
    assert result.done and result.info["done_reason"] == "max_turns"
    assert result.observations[0]["content"] == "1"


async def test_an_unreachable_sandbox_fails_the_episode_instead_of_scoring_it():
    """A dead port: the step raises, so run_episode marks the episode failed (infra)."""
    dead = SandboxClient(SandboxClientConfig(url=f"http://127.0.0.1:{free_port()}", max_retries=1))
    env = RetoolEnv(dead, RetoolConfig(max_turns=3))
    await env.reset("p")
    with pytest.raises(SandboxUnavailableError, match=r"connection_error after 2 attempt"):
        await env.step(code_turn("print(1)"))
    assert env.sandbox_statuses == {"connection_error": 1}


async def test_step_before_reset_is_an_error():
    with pytest.raises(RuntimeError, match="reset"):
        await RetoolEnv(SandboxClient()).step({"role": "assistant", "content": "x"})


@linux_only
async def test_full_episode_through_run_episode(client, qwen3, make_engine):
    call = render_tool_call(ToolCall("code_interpreter", {"code": "print(sum(range(101)))"}))
    engine = make_engine([f"I will add them.\n{call}", "The sum is \\boxed{5050}."])
    env = RetoolEnv(client)
    trajectory = await run_episode(engine, env, qwen3, {"problem": "Sum 0..100?"}, RolloutConfig())
    assert trajectory.status == "completed"
    assert trajectory.num_tool_calls == 1
    info = trajectory.metadata["env_info"]
    assert info["final_answer"] == "5050" and info["num_turns"] == 2
    text = qwen3.decode(trajectory.response_ids)
    assert "5050" in text.split("</tool_call>")[1]  # the tool's output reached the model
    sent = json.loads(call.split("\n")[1])["arguments"]["code"]
    assert sent == "print(sum(range(101)))"


@linux_only
async def test_a_sandbox_outage_is_a_failed_episode_not_a_scored_one(qwen3, make_engine):
    call = render_tool_call(ToolCall("code_interpreter", {"code": "print(1)"}))
    engine = make_engine([f"Compute.\n{call}", "\\boxed{1}"])
    dead = SandboxClient(SandboxClientConfig(url=f"http://127.0.0.1:{free_port()}", max_retries=0))
    trajectory = await run_episode(engine, RetoolEnv(dead), qwen3, "p", RolloutConfig())
    assert trajectory.status == "failed"
    assert trajectory.metadata["error"].startswith("SandboxUnavailableError: the sandbox did not")


@linux_only
async def test_a_sandbox_killed_mid_run_fails_the_episode_at_once(qwen3, make_engine):
    """The sandbox server and its runs get SIGKILL while a run is in flight (not a port
    that never listened): the episode ends `failed` well before the run's 30 s timeout,
    nothing is scored, and none of the server's run processes survive."""
    call = render_tool_call(
        ToolCall("code_interpreter", {"code": "import time\ntime.sleep(30)\nprint(1)"})
    )
    engine = make_engine([f"Compute.\n{call}", "\\boxed{1}"])
    server = EmbeddedSandbox(*TEST_SERVER_ARGS).start()
    config = SandboxClientConfig(url=server.url, max_retries=1, run_timeout=30)
    client = SandboxClient(config)
    uids = server.ping()["isolation"]
    try:

        async def kill_when_running() -> float:
            while not server.processes():
                await asyncio.sleep(0.05)
            assert server.process is not None
            os.killpg(server.process.pid, signal.SIGKILL)
            return time.monotonic()

        killer = asyncio.create_task(kill_when_running())
        env = RetoolEnv(client, RetoolConfig(max_turns=3))
        episode = run_episode(engine, env, qwen3, "p", RolloutConfig())
        trajectory = await asyncio.wait_for(episode, 25)
        killed_at = await killer
        assert time.monotonic() - killed_at < 15
    finally:
        server.stop()
        client.close()
    assert trajectory.status == "failed"
    assert trajectory.metadata["error"].startswith("SandboxUnavailableError"), trajectory.metadata
    assert env.sandbox_statuses == {"connection_error": 1}
    assert len(engine.calls) == 1  # the episode stopped at the outage: no answer scored
    for entry in uids:
        low, high = entry.get("uids", (0, 0))
        assert sandbox_processes(low, high - low) == []
